"""The gRPC backend: placement attempts, their migration, and the ``n`` choices sharing one placement."""
