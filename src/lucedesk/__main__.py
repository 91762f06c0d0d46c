from lucedesk.cli import main

raise SystemExit(main())
