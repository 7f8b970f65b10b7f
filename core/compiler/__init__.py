"""A spec and a plan become a Program of static graphs; the reference interpreter runs them; artifacts hold them
built."""
