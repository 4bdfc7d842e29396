"""Building blocks megatron-core does not ship, plugged in through layer specs or after `GPTModel`
is built — never by editing megatron-core."""
