// Everything a fabric-lib user needs.
#pragma once

#include "fabric/address.h"
#include "fabric/config.h"
#include "fabric/engine.h"
#include "fabric/status.h"
#include "fabric/transfer.h"
