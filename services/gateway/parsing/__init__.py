"""A model's reply markup: parsers (reasoning, tool calls, K3's XTML) and the grammars that constrain it."""
