"""Serving: the catalog of models, the pool that loads them, the one worker thread and what it owns (the
governor's gate, the ladder, the cost meter, the memory plan, the sliding window), and the seams it uses
(grammars, tokenizers). It imports no dialect and no HTTP code."""
