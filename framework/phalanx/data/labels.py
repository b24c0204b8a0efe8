"""The label that marks a position as "not a target" (padding, a prompt, an EOS pad).

-100 is PyTorch's `cross_entropy` default `ignore_index` and Hugging Face's convention, so labels
built here feed any loss unchanged. It lives with the data that writes it; the losses
(`phalanx.train.losses`) import it from here.
"""
IGNORE_INDEX = -100
