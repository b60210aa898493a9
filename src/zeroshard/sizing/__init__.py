"""What fits where: the ZeRO paper's memory and communication formulas (`estimate.py`), the
least-communication configuration that fits (`plan.py`), and their commands (`cli.py`)."""
