"""Warm ranks kept between cells (``RankPool``, ``%%ranks``): the pool, the channel its
ranks answer on, one operation's following, and a run launched onto the pool."""
