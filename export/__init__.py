"""ONNX export and engine building, installed as ``ldlm.export``.

Planned stages (see the open issues): ``export_graphs`` (ONNX per inference graph),
``verify_onnx`` (LayerNormalization checks) and ``build_engine`` (TensorRT).
"""
