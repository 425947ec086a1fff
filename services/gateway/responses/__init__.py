"""OpenAI's Responses API (``/v1/responses``): request, input, output, stream and stored responses."""
