"""Sharded embedding collections and the sharder and plan checks that build them."""
