"""`zeroshard.estimate`: the estimator's public import path (the code is in `sizing/estimate.py`)."""

from .sizing.estimate import *  # noqa: F401,F403
