"""W8A8 FFN graphs with SmoothQuant smoothing and an FP16 low-rank branch (SVDQuant carried to the RK3588 NPU):
calibration capture, the per-block transform, a fake-quant emulator of the toolkit's simulator, the ONNX graph,
hybrid-quantized RKNN conversion, and the gates a model must pass before its manifest lists them."""
