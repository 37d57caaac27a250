"""The LayerNorm promise in one home: every LayerNorm exported as one LayerNormalization with its module's eps.
Checked on the ONNX (``verify``), on TensorRT's parsed network (``trt_network``), by running each one alone
(``eps_probe*`` with the design ``cases``), and by the comparator and tolerances parity shares (``compare``)."""
