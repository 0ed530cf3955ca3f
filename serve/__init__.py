"""The imperative shell: the serving demo now; sessions, scheduling and the radix cache later."""
