"""``kervan plan``: what a model needs to serve a load within its latency targets.

The arithmetic of serving, as a tool: weights times bytes per parameter is the floor of
memory; KV bytes per token times context times concurrency is what grows; what is left
decides the batch, the batch decides a worker's throughput, and the latency targets cap
the batch. ``model_shape`` counts a model's bytes and FLOPs, ``hardware`` describes a
device (named GPUs from their datasheets, or this machine measured), ``sizing`` chooses
the layout (tensor and pipeline parallel), the decode batch and the prefill and decode
pools, and says why."""
