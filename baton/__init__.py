"""Baton: disaggregated LLM serving with speculative decoding."""
