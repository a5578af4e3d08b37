"""Test helpers: an offline tiny model and a real vLLM server launcher."""
