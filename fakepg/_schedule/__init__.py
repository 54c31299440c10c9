"""The controlled scheduler's parts (the public names live in :mod:`fakepg.schedule`):

- ``timeline``: :class:`Schedule`, its events and :class:`ScheduleDeadlock`;
- ``actors``: what runs (a rank's thread, a rank's completion lane) and its state;
- ``scheduler``: the decisions at each point and the hand-over of the turn;
- ``monitor``: a holder blocked where no point sees it (sampling: ``probe``);
- ``deadlock``: the report of a schedule under which nothing can move;
- ``waits``: waits that are points (an event's, any torch future's).
"""
