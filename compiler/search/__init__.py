"""`kiln search`: the cheapest deployment of a recipe that passes its gate, per GPU."""
