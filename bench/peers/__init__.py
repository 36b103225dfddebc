"""Peers jengine is raced against in bench/: transformers and llama.cpp drivers."""
