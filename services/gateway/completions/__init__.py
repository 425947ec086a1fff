"""Legacy text completions (``/v1/completions``): request, prompt, endpoint and stream."""
