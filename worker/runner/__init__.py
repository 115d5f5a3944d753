"""The model runner: batch tensors in, sampled tokens out."""
