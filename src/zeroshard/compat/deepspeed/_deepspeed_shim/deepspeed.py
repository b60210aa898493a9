"""`import deepspeed` under `zeroshard run`: DeepSpeed's names answered by zeroshard
(zeroshard/compat/deepspeed/alias.py); this module replaces itself in sys.modules."""

from zeroshard.compat.deepspeed.alias import install

install()
