"""The ZeRO mechanics, independent of where state is placed: the one layout (`layout.py`: units,
flat buffers, shards), stage-3 units (`partition.py`), the stage policies (`policy.py`,
`stage0.py`..`stage3.py`), the stage-3 schedule, the sharded optimizer (`optim.py`), the fp16
loss scaler, `GatheredParameters` and `Init`. Collectives, process groups, the desync watchdog,
side streams and host memory are dist/'s."""
