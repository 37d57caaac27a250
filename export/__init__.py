"""ONNX export and engine building, installed as ``ldlm.export``.

The stages, each one function behind one command:
  ``onnx_export.export_graphs``      ``ldlm export``        a checkpoint -> one verified ONNX file per inference graph
                                                          and a manifest (files + sha256, I/O, LayerNorm specs);
  ``onnx_export.verify_export``      ``ldlm verify-onnx``   ``layernorm.verify.verify_onnx`` on an export: every
                                                          LayerNormalization node against its module (eps, axis, scale, bias);
  ``engine_builder.build_engines``   ``ldlm build-engine``  verified ONNX -> one TensorRT plan per graph.
Shared by them and by the runtime: ``artifact`` (reading and checking manifests), ``graphs`` (the
graphs and their I/O), ``precision`` (the FP16/BF16 cast pass), ``profiles`` (optimization
profiles), ``trt_flavor`` (TensorRT or TensorRT-RTX), ``quantize``, ``qdq`` and ``calibration`` (INT8 and FP8);
``layernorm/`` holds every check of the LayerNorm promise.
"""
