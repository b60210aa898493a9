"""The older import paths of the integrations (`zeroshard.integrations.hf`, `.lightning`,
`.accelerate`, `.deepspeed_alias`, ...): thin modules re-exporting from their home in
`zeroshard.compat` (compat/hf, compat/lightning.py, compat/accelerate, compat/deepspeed)."""
