"""Decoder models served by Kervan."""
