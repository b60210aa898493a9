"""Muon with an auxiliary Adam, as DeepSpeed 0.19.8's `"optimizer": {"type": "Muon"}` defines it.

Muon (MomentUm Orthogonalized by Newton-Schulz, Keller Jordan 2024) keeps one momentum buffer
per matrix and replaces each matrix update by an approximately orthogonal matrix:

    m <- beta*m + (1-beta)*g            (a lerp of m towards g)
    u <- (1-beta)*g + beta*m            (Nesterov; the update Newton-Schulz orthogonalises)
    O <- NS5(u) * sqrt(max(1, rows/cols))
    p <- p*(1 - lr*wd) - lr*O

NS5 is five steps of the quintic iteration X <- aX + (bA + cA^2)X, A = XX^T, with DeepSpeed's
(and Muon's) coefficients (3.4445, -4.7750, 2.0315), started from the update divided by its
Frobenius norm (+1e-7) and run on the wide orientation (rows <= cols). `ns_method` "gram" (the
default) runs the same iteration on the small Gram matrix R = XX^T, restarting from X once after
two steps; on square matrices it is the plain iteration. A 4-D (convolution) update is
orthogonalised as [out, in*kh*kw]; other ranks > 2 batch over the leading dimensions.

Which parameters get Muon (DeepSpeed's rule, `set_optimizer_flags`): every parameter whose layer
shape has 2 or more dimensions and whose name contains neither "embed" nor "lm_head"; the rest
(embeddings, the output head, biases, norms) get Adam (decoupled weight decay unless
`adam_w_mode` is false). Defaults as DeepSpeed's: Muon lr 0.02, momentum 0.95, weight decay 0,
ns_method "gram"; Adam lr 3e-4, betas (0.9, 0.95), eps 1e-10, weight decay 0; the config's `lr`
sets both halves, `muon_lr` / `adam_lr` one each.

Newton-Schulz dtype: as DeepSpeed picks it per accelerator — "gram" in fp16 where the device
has fp16 matrix products (CUDA; CPUs with mkldnn fp16), "standard" in bf16 (CUDA with bf16,
and CPUs, as DeepSpeed's CPU accelerator says), else fp32. `zeroshard_ns_dtype` ("fp32",
"fp16", "bf16") overrides it; fp32 makes a sharded run equal a single-process one to fp32
rounding (the equivalence tests use it).

Inside zeroshard the optimizer is re-seated over flat 1-D shards and `MuonExchange`
(`muon_exchange.py`) has already put the orthogonalised update where the gradient was, so a Muon
group's step is the last line above, elementwise. On whole (>= 2-D) parameters, outside
zeroshard, `step()` runs Muon itself, as DeepSpeed's MuonWithAuxAdam does at stage 0.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from .layout import full_shape

NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)
NS_STEPS = 5
NS_METHODS = ("gram", "standard")
NS_DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
#: DeepSpeed's parameter-name words that keep a matrix on Adam.
ADAM_NAME_WORDS = ("embed", "lm_head")
MUON_DEFAULTS = {"lr": 0.02, "momentum": 0.95, "weight_decay": 0.0, "ns_method": "gram"}
ADAM_DEFAULTS = {"lr": 3e-4, "betas": (0.9, 0.95), "eps": 1e-10, "weight_decay": 0.0}
#: The config keys each half of a param group takes (DeepSpeed's split).
MUON_KEYS = ("lr", "momentum", "weight_decay", "ns_method")
ADAM_KEYS = ("lr", "betas", "eps", "weight_decay")
_GRAM_RESTART = 2


# -- Newton-Schulz ---------------------------------------------------------------------------------
def ns_dtype(method: str, device: torch.device, choice: str = "auto") -> torch.dtype:
    """The dtype Newton-Schulz runs in on `device` (module docstring), or `choice` if not auto."""
    if choice != "auto":
        return NS_DTYPES[choice]
    if method == "gram":
        if device.type == "cuda":
            return torch.float16
        fp16 = getattr(torch.ops.mkldnn, "_is_mkldnn_fp16_supported", None)
        return torch.float16 if device.type == "cpu" and fp16 is not None and fp16() \
            else torch.float32
    if device.type == "cuda":
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float32
    return torch.bfloat16 if device.type == "cpu" else torch.float32


def _unit_frobenius(x: torch.Tensor) -> torch.Tensor:
    return x / (x.norm(dim=(-2, -1), keepdim=True) + 1e-7)


def _quintic(x: torch.Tensor, steps: int) -> torch.Tensor:
    a, b, c = NS_COEFFICIENTS
    for _ in range(steps):
        gram = x @ x.mT
        x = a * x + (b * gram + c * gram @ gram) @ x
    return x


def _gram_quintic(x: torch.Tensor, steps: int) -> torch.Tensor:
    """The quintic iteration on a wide `x` (rows < cols) through R = XX^T: X_k = Q_k X_0 with
    Q_{k+1} = P_k Q_k, P_k = aI + bR_k + cR_k^2 and R_{k+1} = P_k R_k P_k (P_k commutes with
    R_k); X itself is formed again at the restart and at the end."""
    a, b, c = NS_COEFFICIENTS
    eye = torch.eye(x.size(-2), dtype=x.dtype, device=x.device)
    r = x @ x.mT
    q = None
    for i in range(steps):
        if i == _GRAM_RESTART:
            x = q @ x
            r = x @ x.mT
            q = None
        p = a * eye + b * r + c * r @ r
        q = p if q is None else p @ q
        if i + 1 < steps and i + 1 != _GRAM_RESTART:
            r = p @ r @ p
    return q @ x


def orthogonalize(update: torch.Tensor, method: str = "gram",
                  dtype: torch.dtype = torch.float32, steps: int = NS_STEPS) -> torch.Tensor:
    """NS5 of a >= 2-D `update` over its last two dimensions, in `dtype` (shape kept)."""
    tall = update.size(-2) > update.size(-1)
    x = update.mT if tall else update
    if method == "standard":
        x = _quintic(_unit_frobenius(x.to(dtype)), steps)
    else:
        # Normalised before the cast: a large fp32 update would overflow fp16 on the way in.
        wide = _unit_frobenius(x.to(torch.float32 if x.dtype == torch.float16 else x.dtype))
        x = wide.to(dtype)
        x = _quintic(x, steps) if x.size(-2) == x.size(-1) else _gram_quintic(x, steps)
    return x.mT if tall else x


def aspect_scale(rows: int, cols: int) -> float:
    """sqrt(max(1, rows / cols)): Muon's scale for tall matrices."""
    return math.sqrt(rows / cols) if rows > cols else 1.0


def muon_update(grad: torch.Tensor, momentum: torch.Tensor, beta: float, method: str = "gram",
                dtype: torch.dtype = torch.float32, nesterov: bool = True
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """`(update, new momentum)` of one whole matrix (module docstring); `momentum` is not
    written, so a step that is later skipped leaves it as it was."""
    new_momentum = momentum.lerp(grad.to(momentum.dtype), 1 - beta)
    u = grad.to(momentum.dtype).lerp(new_momentum, beta) if nesterov else new_momentum
    shape = grad.shape
    if u.dim() == 4:  # a convolution filter: [out, in * kh * kw]
        u = u.reshape(shape[0], -1)
    out = orthogonalize(u, method, dtype) * aspect_scale(shape[-2], shape[-1])
    return out.to(grad.dtype).reshape(shape), new_momentum


# -- which parameters get Muon ---------------------------------------------------------------------
def uses_muon(name: str, param: nn.Parameter) -> bool:
    """DeepSpeed's rule: a >= 2-D layer shape, and no "embed" / "lm_head" in the name."""
    return len(full_shape(param)) >= 2 and not any(w in name.lower() for w in ADAM_NAME_WORDS)


def muon_param_groups(module: nn.Module, params, hp: dict) -> list[dict]:
    """Split each incoming param group (or the plain parameter list) into its Muon half and its
    Adam half, settings resolved as DeepSpeed does: the config's value, then `muon_lr` /
    `adam_lr`, then the incoming group's own value (only the half's keys)."""
    names = {id(p): n for n, p in module.named_parameters()}
    groups, loose = [], []
    for item in params:
        (groups if isinstance(item, dict) else loose).append(item)
    if loose or not groups:
        groups.append({"params": loose})
    halves = []
    for use, label, keys, override in ((True, "muon", MUON_KEYS, "muon_lr"),
                                       (False, "adam", ADAM_KEYS, "adam_lr")):
        base = {k: hp[k] for k in keys if k in hp}
        if override in hp:
            base["lr"] = hp[override]
        halves.append((use, label, keys, base))
    out = []
    for index, group in enumerate(groups):
        own = {k: v for k, v in group.items() if k != "params"}
        trainable = [p for p in group["params"] if p.requires_grad]
        for use, label, keys, base in halves:
            half = [p for p in trainable if uses_muon(names.get(id(p), ""), p) is use]
            if not half:
                continue
            settings = {**base, **{k: v for k, v in own.items() if k in keys}}
            prefix = own.get("name") or (f"group{index}" if len(groups) > 1 else None)
            name = f"{prefix}-{label}-params" if prefix else f"{label}-params"
            out.append(dict(params=half, use_muon=use, name=name, **settings))
    return out


# -- the optimizer -------------------------------------------------------------------------------
class MuonWithAuxAdam(torch.optim.Optimizer):
    """Muon for the groups with `use_muon=True`, Adam(W) for the others (module docstring).

    Every param group needs a `use_muon` flag; missing settings take DeepSpeed's defaults.
    """

    #: ZeroOptimizer's marker: the Muon groups are orthogonalised by `MuonExchange` first.
    _zeroshard_muon = True

    def __init__(self, param_groups, adam_w_mode: bool = True, ns_dtype: str = "auto"):
        """`param_groups`: dicts with `params` and `use_muon`; `adam_w_mode`: decoupled weight
        decay for the Adam groups (false: L2, added to the gradient); `ns_dtype`: "auto"
        (DeepSpeed's choice per device) or "fp32" / "fp16" / "bf16"."""
        groups = [dict(g) for g in param_groups]
        for i, group in enumerate(groups):
            if "use_muon" not in group:
                raise ValueError(f"MuonWithAuxAdam: param group {i} has no 'use_muon' flag; give "
                                 "each group use_muon=True (matrices) or False (Adam)")
            for key, value in (MUON_DEFAULTS if group["use_muon"] else ADAM_DEFAULTS).items():
                group.setdefault(key, value)
            if group["use_muon"] and group["ns_method"] not in NS_METHODS:
                raise ValueError(f"MuonWithAuxAdam: param group {i} ns_method "
                                 f"{group['ns_method']!r}; use 'gram' or 'standard'")
        if ns_dtype != "auto" and ns_dtype not in NS_DTYPES:
            raise ValueError(f"MuonWithAuxAdam: ns_dtype {ns_dtype!r}; use 'auto', 'fp32', "
                             "'fp16' or 'bf16'")
        super().__init__(groups, {})
        self.adam_w_mode = adam_w_mode
        self.ns_dtype = ns_dtype
        adam_groups = self._adam_groups()
        cls = torch.optim.AdamW if adam_w_mode else torch.optim.Adam
        # The Adam half shares these group dicts and this state: LR schedulers and checkpoints
        # see one optimizer.
        self._adam = cls(adam_groups) if adam_groups else None
        if self._adam is not None:
            self._adam.param_groups = adam_groups
            self._adam.state = self.state

    def _adam_groups(self) -> list[dict]:
        return [g for g in self.param_groups if not g["use_muon"]]

    @torch.no_grad()
    def step(self, closure=None):
        """Apply one step: Muon groups from their (orthogonalised) gradients, then Adam."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:  # as DeepSpeed: stepped with a zero gradient (decay, moments)
                    p.grad = torch.zeros_like(p)
            if not group["use_muon"]:
                continue
            for p in group["params"]:
                update = p.grad
                if p.dim() >= 2:  # a whole matrix: nothing orthogonalised it yet
                    state = self.state[p]
                    if "momentum_buffer" not in state:
                        state["momentum_buffer"] = torch.zeros_like(p)
                    update, state["momentum_buffer"] = muon_update(
                        p.grad, state["momentum_buffer"], group["momentum"], group["ns_method"],
                        ns_dtype(group["ns_method"], p.device, self.ns_dtype))
                p.mul_(1 - group["lr"] * group["weight_decay"])
                p.add_(update, alpha=-group["lr"])
        if self._adam is not None:
            self._adam.param_groups = self._adam_groups()
            self._adam.state = self.state
            self._adam.step()
        return loss


def build_muon(module: nn.Module, params, hp: dict) -> MuonWithAuxAdam:
    """The config's Muon (`optimizer.params` already checked by config/optimizer.py)."""
    hp = dict(hp)
    adam_w_mode = hp.pop("adam_w_mode", True)
    choice = hp.pop("zeroshard_ns_dtype", "auto")
    for key in ("torch_adam", "fp32_optimizer_states", "foreach", "per_head_muon"):
        hp.pop(key, None)  # refused values were refused by the config check
    groups = muon_param_groups(module, params, hp)
    if not groups:
        raise ValueError("optimizer Muon: the model has no trainable parameters")
    return MuonWithAuxAdam(groups, adam_w_mode=adam_w_mode, ns_dtype=choice)
