"""What every engine integration shares, with no engine imported: the
``gms_*`` configuration keys (``config``), the layout names and the
published identity (``names``), an engine process's layouts with their
sleep and wake (``memory``), and the errors (``errors``)."""
