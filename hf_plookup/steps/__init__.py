"""Every way of running a laid-out step: eager through the model's own modules or its decoder
layers in C, on a bucket's static buffers, compiled, captured in a CUDA graph, with the LM head's
faster layout; `runner.ModelRunner.run` is the one entry."""
