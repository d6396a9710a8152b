"""Pure tensor math of the conversion: RoPE head mixing, the joint latent, the tiny-latent norm.

Nothing here knows about files, configs or the command line; everything takes and returns tensors.
"""
