"""`evaluate` and `vllm-check`: measure the draft's acceptance in vLLM."""
