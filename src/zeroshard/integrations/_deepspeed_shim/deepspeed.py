"""`import deepspeed` under `zeroshard run`: DeepSpeed's names answered by zeroshard
(zeroshard/integrations/deepspeed_alias.py); this module replaces itself in sys.modules."""

from zeroshard.integrations.deepspeed_alias import install

install()
