"""Running a built variant: one runtime class per module (eager PyTorch, TorchScript, onnxruntime, OpenVINO,
TensorRT) behind the `Runtime` interface of `pipeline.runtimes.base`, the variant catalog and each variant
directory's record. Nothing here builds a variant or imports a builder (`pipeline.variants`), training, evaluation
or deployment: they import this layer."""
