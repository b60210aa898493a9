"""`deepspeed.utils.z3_leaf_module`: DeepSpeed's ZeRO-3 leaf marks, implemented in core/leaf.py
(stage 3 reads them when it chooses its units)."""

from ....core.leaf import (LEAF_ATTR, apply_leaf_module_config, get_z3_leaf_modules,  # noqa: F401
                           set_z3_leaf_module, set_z3_leaf_modules, set_z3_leaf_modules_by_name,
                           set_z3_leaf_modules_by_suffix, unset_z3_leaf_modules, z3_leaf_module)
