"""Recurrent token mixers (Mamba and Mamba-2, gated delta nets, short convolutions, lightning
attention): each sequence's state beside the pages (`recurrent`)."""
