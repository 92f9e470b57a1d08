"""Distributed helpers shaped like those of well-known libraries, for ddpkit's do-no-harm corpus
(tests/test_corpus.py). Each module reproduces, in its own words, the shape of one upstream file
and names it; the corpus scripts in tests/corpus/idioms/ import them as a user's script imports
the real library."""
