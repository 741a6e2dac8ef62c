"""Sharding strategies of embedding-bag collections and the pieces they share (import modules by
path).

``base`` (the strategy protocol, the 1/N gradient rule, feature selection), one module per
strategy (``dp``, ``tw``, ``rw``, ``cw``), the shared lookup and routing halves (``_lookup``,
``_route``), and the layout arithmetic (``layout``) and id bucketization (``bucketize``) they
use.
"""
