"""The distributed axis: DistributedDataParallel's settings and the communication
settings of the backend, as knobs and measured candidates."""
