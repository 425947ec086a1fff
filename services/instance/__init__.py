"""The process shell every engine instance shares, whatever computes its tokens.

``shell.py`` starts the gRPC service, registers with the scheduler, heartbeats and drains;
``runtime.py`` loads the native engine and runs it on one worker thread; ``wire.py`` converts
between what travels between services and the engine's own types. The compute itself lives in
``services/engine`` (native) and ``services/engine_vllm`` (vLLM).
"""
