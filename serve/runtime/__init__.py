"""What runs graphs: one GraphBackend interface over eager/compiled torch, ONNX Runtime and
TensorRT, the dynamic batcher for graph requests and the step-level generation scheduler."""
