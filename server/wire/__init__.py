"""Wire models of the dialects beside OpenAI's (server/schemas.py): Ollama's API, llama.cpp's tokenizer
endpoints, OpenAI's Responses API. Each converts itself to what the shared generation flow takes (an
OpenAI request model, so routing, validation and sampling defaults are the same code for every dialect)."""
