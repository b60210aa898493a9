"""DeepSpeed's names answered by zeroshard: `zero.py`, `comm.py`, `accelerator/`, `ops/`, `utils/`
(what `deepspeed.<x>` maps to under the launcher's alias, `alias.py`), and `_deepspeed_shim/`, the
folder `zeroshard run` puts first on its workers' PYTHONPATH. Import the submodules."""
