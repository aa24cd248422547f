"""Running a converted model: session and KV buffers, the engine, sampling, stops, tokenizer, chat."""
