"""The torch-free text side of a model: where it comes from, its tokenizer and chat template.

The gateway imports this package and never ``services.engine`` (the model compute).
"""
