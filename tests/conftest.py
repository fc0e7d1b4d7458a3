import os

# Tests run on the host CPU; with libtpu installed jax would otherwise probe for a TPU.
os.environ.setdefault("JAX_PLATFORMS", "cpu")
