"""DeepSpeed's `deepspeed.ops.op_builder` names that scripts and tests read to ask whether an op
is available (`CPUAdamBuilder.NAME`, `deepspeed.ops.__compatible_ops__[...]`, `is_compatible()`).

zeroshard builds no C++/CUDA extensions: the optimizers DeepSpeed compiles (`cpu_adam`,
`fused_adam`, `cpu_adagrad`, `cpu_lion`, `fused_lion`) are answered by torch's kernels under
DeepSpeed's class names (`deepspeed.ops.adam`, ...), and NVMe offload (`async_io`) by zeroshard's
own file I/O, so those report compatible; every other op reports incompatible. `load()` returns
nothing to call into and says so.
"""

from __future__ import annotations

#: DeepSpeed op names zeroshard answers, and where.
ANSWERED = {
    "cpu_adam": "deepspeed.ops.adam.DeepSpeedCPUAdam", "fused_adam": "deepspeed.ops.adam.FusedAdam",
    "cpu_adagrad": "deepspeed.ops.adagrad.DeepSpeedCPUAdagrad",
    "cpu_lion": "deepspeed.ops.lion.DeepSpeedCPULion", "fused_lion": "deepspeed.ops.lion.FusedLion",
    "async_io": "zero_optimization.offload_optimizer / offload_param with device 'nvme'",
}


class CompatibleOps(dict):
    """`deepspeed.ops.__compatible_ops__`: op name -> whether it can be used; unknown ops False."""

    def __missing__(self, key) -> bool:
        return False


COMPATIBLE_OPS = CompatibleOps({name: True for name in ANSWERED})


class OpBuilder:
    """Base of the builder names: `NAME`, `is_compatible()`, and a `load()` that explains."""

    NAME = ""

    def is_compatible(self, verbose: bool = False) -> bool:
        """Whether zeroshard answers this op."""
        return COMPATIBLE_OPS[self.NAME]

    def load(self, verbose: bool = True):
        """DeepSpeed returns the compiled extension; zeroshard has none to return."""
        where = ANSWERED.get(self.NAME)
        instead = f"; use {where}" if where else ""
        raise NotImplementedError(f"zeroshard builds no DeepSpeed extension ops ({self.NAME!r} "
                                  f"asked for){instead}")


def _builder(class_name: str, op: str) -> type:
    return type(class_name, (OpBuilder,), {"NAME": op, "__doc__": f"DeepSpeed's {op!r} builder."})


CPUAdamBuilder = _builder("CPUAdamBuilder", "cpu_adam")
FusedAdamBuilder = _builder("FusedAdamBuilder", "fused_adam")
CPUAdagradBuilder = _builder("CPUAdagradBuilder", "cpu_adagrad")
CPULionBuilder = _builder("CPULionBuilder", "cpu_lion")
FusedLionBuilder = _builder("FusedLionBuilder", "fused_lion")
AsyncIOBuilder = _builder("AsyncIOBuilder", "async_io")
FusedLambBuilder = _builder("FusedLambBuilder", "fused_lamb")

__all__ = ["AsyncIOBuilder", "CPUAdagradBuilder", "CPUAdamBuilder", "CPULionBuilder",
           "FusedAdamBuilder", "FusedLambBuilder", "FusedLionBuilder", "OpBuilder"]
