"""ZeRO++ (Wang et al., 2023) as stage-3 strategies (`core/strategies.py` has the plain ones):

  qwZ  `qwz.Int8Weights`           a weight codec: gathers sent as int8 blocks with fp32 scales
  hpZ  `hpz.SecondaryGather`       a secondary shard inside each host for the gathers before the step
  qgZ  `qgz.HierarchicalReduce`    gradients reduced in the host exactly, across hosts in int8

`quantize.py` is the block codec and `collectives.py` the quantized collectives they use.
"""
