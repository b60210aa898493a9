"""`zeroshard.utils.z3_leaf`, an old import path kept working: re-exports
`zeroshard.compat.deepspeed.utils.z3_leaf`, the home of these functions."""

from ..compat.deepspeed.utils.z3_leaf import (LEAF_ATTR, get_z3_leaf_modules, set_z3_leaf_modules,
                                              unset_z3_leaf_modules, z3_leaf_module)  # noqa: F401
