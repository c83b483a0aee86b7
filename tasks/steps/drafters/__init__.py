"""The candidate drafters: their text form and construction, the drafts trained on traffic and the
suffix indexes built from it. Importing this package imports none of its modules."""
