"""Fast forms of operations the encodings share: same values as their plain forms, other programs.

Each module says which backends it is for and keeps the plain form beside it; a test holds
the two equal.
"""
