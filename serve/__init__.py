"""The batched runner over eager / ONNX Runtime / TensorRT and the HTTP service, installed as
``ldlm.serve``. The eager reference it builds on is ``ldlm.pipeline.LDLMPipeline``.
"""
