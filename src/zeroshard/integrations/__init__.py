"""`zeroshard.integrations.hf` and `.lightning`: the documented import paths of the Hugging Face and
Lightning integrations (DESIGN.md's `zeroshard.integrations.hf.from_pretrained`). Each is the very
module of its home in `zeroshard.compat`, not a copy of its names."""
