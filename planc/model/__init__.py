"""What the compiler learns of the user's model: the probe (run in a subprocess, its cache,
the user's code checked on the way), Hugging Face models, the tensor-parallel traffic
measured per stage, and the ``infer`` pass that completes every transfer from it."""
