"""The gateway: OpenAI-compatible REST + SSE in front of the scheduler, prefill and decode.

It tokenizes and applies the chat template, asks the scheduler for a placement, drives prefill
and decode over gRPC, detokenizes, applies stop strings and streams. It never holds weights or KV.
"""
